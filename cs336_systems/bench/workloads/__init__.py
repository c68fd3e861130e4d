"""Benchmark workloads, one module per suite: each builds a step from a case of benchmarks.json.

  lm             forward / forward-backward / train-step of the Transformer LM
  hf_llama       Hugging Face LlamaForCausalLM of the same sizes: the end-to-end suite's baseline
  attention      one attention call (forward, backward, forward+backward), accuracy-checked before timing
  data_parallel  one training step per parallelism variant (DDP wrappers, ZeRO-1, FSDP, torch baselines)
  allreduce      the all-reduce benchmark (algbw / busbw)
"""
