"""User tools: the `pdserve` CLI, the local cluster launcher, the gRPC client library and the
load-test harness (bench/). The outermost room: it may import any other; nothing imports it."""
