"""Process plumbing: where the system's processes run, what they are given, and how they are called.

It owns where actors land (`placement`: node resources and which node each actor is on; `cpu_placement`:
CPU affinity and niceness for processes sharing a node), the environment variables the project's processes
need (`process_env`), the files every node needs to start the policy (`model_files`), calling a group of Ray
actors under one deadline (`actor_calls`), and where each process's output goes (`log_files`). Nothing here
knows what the processes compute.
"""
