"""trust-ladder: qualifies KV-cache handoff between inference engines.

A producer lane computes a prompt's KV cache; a consumer decodes from it. The harness checks
the handoff against a cold local recompute on the consumer under a frozen contract and archives
every run as a verifiable receipt.
"""

__version__ = "0.1.0"
