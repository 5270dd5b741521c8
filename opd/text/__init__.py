"""Text: tokenizers, the chat format and the parsers of model output.

One grammar per format: the chat renderer and the parsers share the special
tokens of ``opd.text.tokenizers`` and one tool-call definition.
"""
from opd.text import chat, parsers, tokenizers
from opd.text.chat import (MODES, ROLES, STOP_TOKENS, InvalidToolCall, Message, ParsedCompletion,
                           Segment, ToolCall, as_message, default_summary, from_raw,
                           generation_prompt, parse_completion, parse_conversation, render,
                           render_for_training, render_segments)
from opd.text.parsers import (ANSWER_PREFIX, AssistantTurn, ParsedAnswer, ParsedCode,
                              ParsedToolCalls, Thinking, extract_python_function, format_answer,
                              format_number, format_tool_call, parse_answer_body,
                              parse_assistant_turn, parse_final_answer, parse_number,
                              parse_tool_calls, split_thinking)
from opd.text.tokenizers import SPECIAL_TOKENS, ByteTokenizer, HFTokenizer, check_vocab
