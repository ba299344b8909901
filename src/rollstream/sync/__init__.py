"""Weights trainer -> engines: the ordering contract and every transport.

    weights.py       WeightSync: the ordering contract (publish, interrupt/continue/drain,
                     apply to every engine, on_applied), calling Engine.load_weights
    protocol.py      the transport protocol: Payload (tensors + a versioned Header: protocol,
                     version, kind, names, dtypes, shapes), Destination, Delivery, Transport
    delta.py         versioned delta sync: wraps a transport to engine actors; an engine
                     that holds the previous version gets only what changed, in its dtype
    object_store.py  to engine actors through Ray's object store (and every path's fallback)
    broadcast.py     to engine actors over one gloo (or NCCL, CUDA) group, in byte buckets
    buckets.py       the bucket plan, and packing a bucket on a device and unpacking it
    shm.py           safetensors buckets in /dev/shm: the store, its reader, and the
                     transport to engine actors on this host
    vllm.py          vLLM's reload path: write to shared memory, pause, reload in place,
                     label the version, resume

In one process no transport is needed: weight sync hands the tensors to the embedded engine,
which copies them into its own parameters between two decode steps. This package imports no
rollout code; engines import its transports, it imports only the engine protocol.
"""
