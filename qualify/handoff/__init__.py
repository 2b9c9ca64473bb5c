"""Authenticated KV handoff across a process boundary: wire format, producer service, client.

``wire`` seals and opens handoffs (safetensors payload, JSON manifest, HMAC-SHA256); ``service``
is the producer process; ``client`` starts it and requests handoffs from the harness side.
"""
