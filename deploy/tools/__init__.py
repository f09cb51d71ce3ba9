"""Tools around a run, not part of one: the learning check (experiment), the dashboard's builder and its check
against a real Prometheus (dashboard, check_dashboard, synthetic_metrics), the offline cluster-file check
(cluster_check) and the trajectory viewer behind `gigpo view` (viewer). The run itself, the orchestrator, is
the rest of deploy/: cli -> system -> the three pools."""
