# Stands in for vllm/logger.py, whose import pulls in vLLM's logging configuration (and through
# it vllm.config and torch). MoRIIO only logs through it: init_logger(name) returns a standard
# `logging.Logger` with vLLM's `*_once` helpers. Log lines change no decision and no byte on the
# wire. The harness leaves them at WARNING and above, on stderr.
import logging


class _VllmLogger(logging.Logger):
    _seen: set = set()

    def _once(self, level, msg, *args):
        key = (level, msg, args)
        if key not in _VllmLogger._seen:
            _VllmLogger._seen.add(key)
            self.log(level, msg, *args)

    def debug_once(self, msg, *args, **kwargs):
        self._once(logging.DEBUG, msg, *args)

    def info_once(self, msg, *args, **kwargs):
        self._once(logging.INFO, msg, *args)

    def warning_once(self, msg, *args, **kwargs):
        self._once(logging.WARNING, msg, *args)


def init_logger(name):
    previous = logging.getLoggerClass()
    logging.setLoggerClass(_VllmLogger)
    try:
        return logging.getLogger(name)
    finally:
        logging.setLoggerClass(previous)
