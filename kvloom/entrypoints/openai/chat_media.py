"""Chat messages with image parts on the server: images loaded and preprocessed off the event loop.

``image_url`` parts are fetched or decoded (kvloom/multimodal/media.py's allowances and limits) and
preprocessed on the model's image pool while the event loop keeps serving; then the conversation is rendered
and tokenized with each image's expansion. Anything wrong (an undecodable, too large or disallowed image, more
images than ``--limit-mm-per-prompt``, images sent to a text-only model) is a 400 naming ``messages``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvloom.engine.input_processor import TokenizedPrompt
from kvloom.entrypoints.openai.serving_engine import APIError, OpenAIServing
from kvloom.multimodal.chat import split_image_parts, template_takes_parts
from kvloom.multimodal.processor import MultiModalProcessor, PreparedImage


async def multimodal_chat_prompt(serving: OpenAIServing, messages: list[Any], add_generation_prompt: bool,
                                 template_kwargs: dict[str, Any] | None,
                                 tools: list[dict[str, Any]] | None) -> TokenizedPrompt:
    """The checked prompt of a conversation that holds images (its ImageFeatures with it)."""
    processor: MultiModalProcessor | None = serving.engine.input_processor.multimodal
    if processor is None:
        raise APIError(f"the messages hold image parts but {serving.model_name} is a text-only model; images "
                       f"need a vision-language model", param="messages")
    template = serving.chat_template if serving.chat_template is not None else serving.tokenizer.chat_template
    try:
        rendered, sources = split_image_parts(messages, processor.placeholder, template_takes_parts(template))
        processor.check_count(len(sources))
    except ValueError as e:
        raise APIError(str(e), param="messages") from None

    def load_and_prepare(kind: str, value: Any) -> PreparedImage:
        return processor.prepare(processor.media.load_image(value) if kind == "url" else value)

    loop = asyncio.get_running_loop()
    try:
        prepared = await asyncio.gather(*(loop.run_in_executor(processor.pool, load_and_prepare, kind, value)
                                          for kind, value in sources))
    except ValueError as e:
        raise APIError(str(e), param="messages") from None
    text = await serving.render_chat_checked(rendered, add_generation_prompt, template_kwargs, tools)
    try:
        # The template already wrote any BOS it wants.
        token_ids, features = processor.process(text, prepared, add_special_tokens=False)
    except ValueError as e:
        raise APIError(str(e), param="messages") from None
    return TokenizedPrompt(text, tuple(token_ids), features)
