"""Images in, text out: a vision-language model offline, through ``multi_modal_data`` and chat image parts.

A SmolVLM checkpoint is not on this machine, so this builds a tiny random one (SmolVLM's architecture and
processor, tests/tiny_vision.py) unless KVLOOM_EXAMPLE_MODEL names a real one; with random weights the
replies are random text: the example shows the calls.

    python examples/vision_chat.py
"""

import base64
import io
import os
import sys
import tempfile

import numpy as np
from PIL import Image

from kvloom import LLM, SamplingParams


def main() -> None:
    model = os.environ.get("KVLOOM_EXAMPLE_MODEL")
    if model is None:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        import tiny_vision

        model = tiny_vision.build_tiny_idefics3(tempfile.mkdtemp(prefix="kvloom-tiny-smolvlm-"))
    llm = LLM(model=model, limit_mm_per_prompt={"image": 2})
    params = SamplingParams(temperature=0, max_tokens=16)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8))

    # A prompt with one <image> placeholder per image.
    out = llm.generate({"prompt": "User:<image>Describe this image.\nAssistant:", "multi_modal_data": {"image": image}},
                       params, use_tqdm=False)
    print("generate:", repr(out[0].outputs[0].text), f"({len(out[0].prompt_token_ids)} prompt tokens)")

    # Chat: an image as a data: URL (what the OpenAI server takes too) and as a PIL image.
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    reply = llm.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_pil", "image_pil": image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)},
        {"type": "text", "text": "What differs between these two?"}]}], params, use_tqdm=False)
    print("chat:", repr(reply[0].outputs[0].text))


if __name__ == "__main__":
    main()
