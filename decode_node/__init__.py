"""Decode node: an engine in decode mode plus the receiving side of the KV messenger.

It serves the client API (the router forwards to it), admits each request with non-evictable
pages for its prompt, asks a prefill node to fill them over the fabric, and decodes once the
immediate-data count completes (DESIGN section 1, D2-D4, D17, S3, S5).

Modules: `service` (the thin server: config, engine + the decode side's transfers
(kv_messenger.decode) + prefill pool, one RequestState per request; no gRPC server), `server`
(thin gRPC servicers; the process lifecycle is pdserve.serving.node_server's), `prefill_pool`
(which prefill node gets a prompt; the transfers' PrefillClient, gRPC errors converted there),
`__main__` (parses the command line, nothing else). The transfer protocol and why it is safe:
docs/transfer-safety.md. This package reaches the transport only through kv_messenger.
"""
