# Stands in for the `regex` package (`import regex as re` in moriio_common.py) with Python's own
# `re`. MoRIIO compiles two patterns with it, `___prefill_addr_(.+?)___decode_addr_` and
# `___decode_addr_(.+)_[0-9a-f]{32}(?:-.*)?$` (peer addresses embedded in request ids): lazy and
# greedy groups, a class, a count, a non-capturing group and an anchor, all of which `re` and
# `regex` define identically (regex's extras, such as fuzzy matching, possessive quantifiers and
# \p classes, appear in neither). The harness's paths do not even reach them.
from re import *  # noqa: F401,F403
from re import compile, escape, error, fullmatch, match, search, sub  # noqa: F401
