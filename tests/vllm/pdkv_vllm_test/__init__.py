"""A test harness that runs vLLM's own engine, scheduler and KV connector hooks on CPU.

Only the model's forward pass and sampling are replaced (see worker.py); the forward writes
known bytes (kvpattern.py) so that a decode engine can check every KV byte a connector moved.
"""
