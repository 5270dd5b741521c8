"""Text: tokenizers (the byte tokenizer, ``tokenizer.json`` files and the task
BPE tokenizer of ``bpe``), the chat format and the parsers of model output.

One grammar per format: the chat renderer and the parsers share the special
tokens of ``opd.text.tokenizers`` and the one tool-call grammar of
``opd.text.tool_calls``.
"""
from opd.text import bpe, chat, parsers, tokenizers, tool_calls
from opd.text.bpe import BPEConfig, BPETokenizer, build_bpe, parse_tokenizer_spec, resolve_tokenizer
from opd.text.chat import (MODES, ROLES, STOP_TOKENS, Message, ParsedCompletion, Segment,
                           as_message, default_summary, from_raw, generation_prompt,
                           parse_completion, parse_conversation, render, render_for_training,
                           render_segments)
from opd.text.parsers import (ANSWER_PREFIX, AssistantTurn, ParsedAnswer, ParsedCode,
                              ParsedToolCalls, Thinking, extract_python_function, format_answer,
                              format_number, parse_answer_body, parse_assistant_turn,
                              parse_final_answer, parse_number, parse_tool_calls, split_thinking)
from opd.text.tokenizers import SPECIAL_TOKENS, ByteTokenizer, HFTokenizer, check_vocab
from opd.text.tool_calls import (InvalidToolCall, ToolCall, ToolCallScan, decode_tool_call,
                                 format_tool_call, scan_tool_calls)
