"""Past one device: tensor parallelism and disaggregated prefill/decode, on ``torch.distributed``.

Two ideas, one room:

* **Tensor parallelism** (Megatron-LM, Shoeybi et al. 2019, §3; vLLM's ``tensor_parallel_size``): every
  rank holds a slice of every layer's weights, runs the same forward on its slice, and two all-reduces per
  block put the slices back together. ``parallel_linear.py`` (the column/row split), ``tp_model.py`` (GPT-2
  split by heads), ``tp_engine.py`` (the driver/worker split: what crosses to the workers each step).
* **Disaggregated prefill and decode** (DistServe, Zhong et al. OSDI'24; Splitwise, ISCA'24; vLLM's
  disaggregated prefill with KV connectors): a prefill instance and a decode instance, each a whole engine
  in its own process with its own KV pool; the prompt's K/V moves from one to the other.
  ``kv_transfer.py`` (the connector and what it sends), ``disagg.py`` (the instances and the router).

``comm.py`` owns the process groups: gloo on CPU, NCCL on GPUs, every collective under a timeout, and
``torchrun``'s environment variables when they are set.
"""
