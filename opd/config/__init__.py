"""Configs: ml-collections loading, command-line overrides and conversion to dataclasses.

``fields`` holds the validators every config dataclass uses (``check_fields``:
a ``__post_init__``'s whole block in one call), ``from_group``,
the one converter from a config group to a dataclass, and ``to_group``, which
builds a config file's group from a dataclass's defaults; ``migrations`` maps
the paths of older config layouts to today's.
"""
from opd.config.fields import (check_bool, check_choice, check_fields, check_float, check_int,
                               from_group, set_field, to_group)
from opd.config.migrations import migrate, moved_to
from opd.config.overrides import (apply_overrides, config_mismatches, config_to_dict,
                                  load_config, load_config_module, load_sweep, parse_arg,
                                  split_config_spec)
