"""pdkv's KV connector for vLLM (``PdkvConnector``) and its native module."""

from pdkv._native import version

__all__ = ["version"]
__version__ = version()
