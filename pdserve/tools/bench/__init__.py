"""`pdserve bench`: the load-test harness (L1-L4).

Modules, one job each:
- datasets: the requests to send (random or fixed lengths, the shipped prompt set, a JSONL file);
- arrivals: when to send them (Poisson or gamma inter-arrival times at a request rate);
- backends: how to send one request and time its stream (gRPC via pdserve.tools.client, OpenAI HTTP SSE);
- records: a streamed request's timeline turned into a RequestRecord (TTFT, ITLs, E2E, tokens);
- metrics: pure arithmetic over records, with vLLM's definitions (TTFT, TPOT, ITL, E2E, throughputs,
  per-user TPS, goodput; mean, median, p90, p99);
- runner: the asyncio driver (arrivals, concurrency cap, duration cap, progress bar);
- report: the terminal table and the result JSON; plots: PNG CDFs and sweep curves;
- prometheus: a server's histograms scraped from /metrics, to check the client's view against;
- sweep, compare: many runs (request rates; colocated vs disaggregated clusters);
- cli: `add_parser(subparsers)` for `pdserve bench {serve,sweep,compare}`.
"""
