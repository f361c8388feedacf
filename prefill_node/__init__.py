"""prefill_node: a gRPC server running the engine in prefill-only mode with the sending KV messenger.

    python -m prefill_node --port 50061 --provider shm [engine flags]

Decode nodes call `PrefillService.Prefill` with a prompt (minus its last token) and where its KV
goes; the node feeds its own batch scheduler (chunked prefill), pushes each finished layer's pages
with one-sided writes, writes the context (hidden state, top logits), frees its pages once every
write completed locally, and answers. Any number of decode nodes may call one node (D1).

Modules: `service` (the engine and the prefill side of the transfer, kv_messenger.prefill_transfers,
which builds the fabric endpoint and the sender: the request lifecycle; no gRPC server), `server`
(thin gRPC servicers and wire conversion; the process lifecycle is pdserve.serving.node_server's),
`__main__` (parses the command line, nothing else).
"""

from prefill_node.service import PrefillNode, PrefillNodeConfig, PrefillSpec

__all__ = ["PrefillNode", "PrefillNodeConfig", "PrefillSpec"]
