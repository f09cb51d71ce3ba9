"""The trajectory stream: how finished episode groups travel from rollout actors to the learner.

It owns the records every plane shares (`records`: a step, a trajectory, an episode group), their wire format
(`codec`: msgpack and raw arrays, nothing trusted on decode), the boundary's interface with its in-memory twin
(`interface`: TrajectorySink / TrajectorySource), the Redis stream behind it with the producers' admission
rule (`redis_stream`), and the Redis it runs on: a client that rides out restarts and keeps passwords out of
sight (`redis_client`), and the server a run starts when it is given none (`redis_server`). Which groups the
learner trains on is not decided here: that is the learner's read policy (learner/read_policy.py).
"""
