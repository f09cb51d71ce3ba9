"""Weight sync: how the learner's updated weights reach the vLLM inference actors.

It owns the boundary's interface with its in-memory twin (`interface`: WeightPublisher), the sending half the
learner's rank 0 runs (`sender`: shared-memory files, a collective, or CUDA IPC, chosen by
`inference.weight_transfer`), the receiving half each inference actor runs (`receiver`: loading a push while
no request is in flight), the gloo backend both halves use to move weights over the network on CPU (`gloo`,
registered with vLLM as a plugin), and the shared-memory files weight sync and vLLM's engine leave behind
(`shm_cleanup`).
"""
