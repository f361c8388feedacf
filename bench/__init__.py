"""pdserve's benchmarks, a package by subject; run each as a module from the repository root.

    python -m bench.engine.throughput --systems pdserve,hf-static
    python -m bench.ab --base /tmp/before --head . -- bench.engine.throughput --systems pdserve

Subjects: engine (one process: throughput, passes, kernels), fabric (the transfer engine), cluster
(router + prefill + decode processes), spec (speculative decoding), tp (tensor parallel), faults
(issue 15's fault matrix). Shared helpers in bench.common: machine info, the results writer that
stamps commit, date and machine on every file, paired alternating runs, cluster start. bench.ab runs
any benchmark module against two source trees, alternating. bench/README.md lists every benchmark,
every kept result and the command that made it. Nothing here is imported by the library.
"""
