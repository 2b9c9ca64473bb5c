"""Authenticated KV handoff between a producer and the consumer: wire format, protocol, transports.

``wire`` seals and opens handoffs (safetensors payload, JSON manifest, HMAC-SHA256); ``protocol``
is what producer and harness share (frames, client auth, start expectation, handed-off positions);
``service`` is the producer process; ``transport`` is the consumer's edge (``Transport``, and the
in-process producer); ``client`` starts the producer process and requests handoffs over its socket.
"""
