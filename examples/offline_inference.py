"""The seeds' offline example (shared/seeds/000), with only the import line changed and the device
argument left out. The model is the default SmolLM2-135M-Instruct unless KVLOOM_EXAMPLE_MODEL names
another (the tests point it at a tiny checkpoint); TinyLlama is not on this machine.

    python examples/offline_inference.py
"""

import os

from kvloom import LLM, SamplingParams

# The seed splits its model over 2 NeuronCores (tensor_parallel_size=2). The default model's 9 attention heads do
# not split in two, so one rank here; KVLOOM_EXAMPLE_TP=2 splits a model whose heads do.
tensor_parallel_size = int(os.environ.get("KVLOOM_EXAMPLE_TP", "1"))

# Sample prompts.
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
# Create a sampling params object.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

# Create an LLM.
llm = LLM(
    model=os.environ.get("KVLOOM_EXAMPLE_MODEL", "SmolLM2-135M-Instruct"),
    max_num_seqs=8,
    # The max_model_len and block_size arguments are required to be same as max sequence length,
    # when targeting neuron device. Currently, this is a known limitation in continuous batching
    # support in transformers-neuronx.
    max_model_len=128,
    block_size=128,
    tensor_parallel_size=tensor_parallel_size)
# Generate texts from the prompts. The output is a list of RequestOutput objects
# that contain the prompt, generated text, and other information.
outputs = llm.generate(prompts, sampling_params)
# Print the outputs.
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
