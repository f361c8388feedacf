"""pdserve's wire contract: versioned protobuf packages and what every gRPC server shares.

pdserve_api.v1    generated stubs of ``pdserve.api.v1`` (client API, node-to-node API); the
                  ``.proto`` files beside them are the source, ``proto/generate.py`` regenerates
pdserve_api.servers  hand-written: standard health + reflection services, exception -> status
                  mapping (interceptors and a decorator)

Kept apart from the ``pdserve`` package on purpose: the generated imports read
``from pdserve_api.v1 import x_pb2`` and must never shadow ``pdserve``.
"""
