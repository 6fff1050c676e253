"""A script written against vLLM's offline API; only the import line names sparsevllm.

tests/api/test_vllm_compat.py runs it unchanged (MODEL comes from the environment).
"""

import os

from sparsevllm import LLM, SamplingParams

prompts = ["Hello, my name is", "The capital of France is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=0)

llm = LLM(model=os.environ["MODEL"])
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
    assert output.prompt_token_ids and output.outputs[0].token_ids

# n samples of one prompt: one RequestOutput with n completions.
outputs = llm.generate(prompts[0], SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=1))
assert len(outputs) == 1 and len(outputs[0].outputs) == 2
for completion in outputs[0].outputs:
    print(completion.index, completion.finish_reason, completion.text)

# logprobs and their running sum, per completion.
params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2)
completion = llm.generate(prompts[1], params)[0].outputs[0]
assert len(completion.logprobs) == len(completion.token_ids)
assert completion.cumulative_logprob is not None and completion.cumulative_logprob <= 0

conversation = [{"role": "user", "content": "Hello"}]
outputs = llm.chat(conversation, SamplingParams(max_tokens=4))
print(outputs[0].outputs[0].text)
print("OK")
