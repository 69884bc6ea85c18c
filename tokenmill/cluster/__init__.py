"""Process management for a local cluster: what `tokenmill serve`, the end-to-end tests and the
benchmarks use to run redis-server, worker, scheduler and gateway as child processes.

Its parts, arrows down: the one ClusterConfig (composed of the services' own options) and the child
specs made from it; the supervisor, which starts children in order and stops them in reverse, its
restart monitor and policies, and its own /metrics; one child process with its output; readiness
probes and the redis-server spec; the containers' health check command.

The rule: nothing here imports tokenmill.bench, tokenmill.client or the app modules, and nothing
here imports torch (`tokenmill serve` starts in well under a second); the services are reached only
through their torch-free options modules and as `python -m <service>.main` children.
"""
