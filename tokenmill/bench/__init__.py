"""Every benchmark and measurement command (DESIGN.md, "Benchmark methodology"): `tokenmill bench`
(the standard serving sweep: its workload, targets, runner, report and command), `bench-engine`,
`bench-cluster`, `bench-tracing`, `accuracy`, `int8_agreement` and the peer servers' helpers.

The rule: a benchmark may import cluster/ (to start a cluster), client/, the in-process engine and
the services; nothing in the roof imports a benchmark module (`tokenmill.cli` names them by string,
so the command line never loads torch for them). The workload module is the bottom of this room: it
imports no other benchmark module.
"""
