"""`tokenmill bench`: the standard serving benchmark (DESIGN.md, "Benchmark methodology").

workload.py  the requests (fixed prompt length, seeded output lengths, EOS ignored)
targets.py   what is measured: a tokenmill gRPC gateway, an OpenAI-compatible HTTP server, or an
             in-process transformers baseline with static batches; plus the scheduler load poller
runner.py    sync mode and the async concurrency sweep, warm-up kept out of the timed window
report.py    metrics (percentiles, QPS, tok/s) and the terminal table, JSON, Markdown and PNG plots
cli.py       the command: starts clusters (paged, static) and the baseline, side by side
"""
