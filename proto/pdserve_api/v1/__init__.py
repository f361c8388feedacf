"""Generated stubs of pdserve wire contract v1 (see proto/generate.py); do not edit the *_pb2* files."""
