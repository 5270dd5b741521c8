"""Configs: ml-collections loading, command-line overrides and conversion to dataclasses."""
from opd.config.overrides import (apply_overrides, config_mismatches, config_to_dict,
                                  load_config, load_config_module, load_sweep, parse_arg,
                                  split_config_spec, to_model_config)
