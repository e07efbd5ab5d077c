"""Chat messages with image content parts -> the prompt text (one placeholder per image) and the images.

The parts are OpenAI's and vLLM's: ``{"type": "text", "text": ...}``, ``{"type": "image_url", "image_url":
{"url": ...}}`` (or the URL as a string) and ``{"type": "image_pil", "image_pil": PIL.Image}``. A chat
template that walks a message's content parts itself (SmolVLM's writes ``<image>`` for an image part) gets
the parts, images as ``{"type": "image"}``; any other template gets one string per message, its parts in
order joined by newlines with the model's placeholder where each image was.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

IMAGE_PART_TYPES = ("image_url", "image_pil")
# A template that iterates a message's content (``for part in message['content']``) renders parts itself.
_ITERATES_CONTENT = re.compile(r"for\s+\w+\s+in\s+message(\[\s*['\"]content['\"]\s*\]|\.content(?!\w))")


def has_image_parts(messages: Any) -> bool:
    """Whether any message's content holds an image part (a conversation without one is text-only)."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                             for p in content):
            return True
    return False


def template_takes_parts(template: str | None) -> bool:
    return template is not None and _ITERATES_CONTENT.search(template) is not None


def split_image_parts(messages: list[Any], placeholder: str, takes_parts: bool
                      ) -> tuple[list[dict[str, Any]], list[tuple[str, Any]]]:
    """The messages as the template gets them, and each image in order as ("url", url) or ("pil", image).

    ValueError for a part that is neither text nor an image."""
    rendered: list[dict[str, Any]] = []
    images: list[tuple[str, Any]] = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts: list[dict[str, Any]] = []
        texts: list[str] = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
                texts.append(part["text"])
            elif kind == "image_url":
                value = part.get("image_url")
                url = value.get("url") if isinstance(value, dict) else value
                if not isinstance(url, str):
                    raise ValueError(f"messages[{index}]: an image_url part needs {{'image_url': {{'url': str}}}}")
                images.append(("url", url))
                parts.append({"type": "image"})
                texts.append(placeholder)
            elif kind == "image_pil":
                images.append(("pil", part.get("image_pil")))
                parts.append({"type": "image"})
                texts.append(placeholder)
            else:
                raise ValueError(f"messages[{index}] content parts must be text, image_url or image_pil parts, "
                                 f"got {part!r:.80}")
        rendered.append(dict(message, content=parts if takes_parts else "\n".join(texts)))
    return rendered, images


def chat_prompt(tokenizer: Any, messages: list[Any], multimodal: Any, load_url: Callable[[str], Any] | None,
                add_generation_prompt: bool = True, chat_template: str | None = None,
                **template_kwargs: Any) -> str | dict[str, Any]:
    """``LLM.chat``'s prompt for one conversation: the rendered text, or, when it holds images, the prompt
    dict {"prompt": text, "multi_modal_data": {"image": [...]}} (the images loaded). ``multimodal``: the
    engine's MultiModalProcessor (None: a text model, which refuses image parts)."""
    if not has_image_parts(messages):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, **template_kwargs)
    if multimodal is None:
        raise ValueError("the messages hold image parts but this model is text-only; images need a "
                         "vision-language model (Idefics3ForConditionalGeneration)")
    template = chat_template if chat_template is not None else tokenizer.chat_template
    rendered, sources = split_image_parts(messages, multimodal.placeholder, template_takes_parts(template))
    multimodal.check_count(len(sources))
    images = [load_url(value) if kind == "url" else value for kind, value in sources]
    text = tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template, **template_kwargs)
    return {"prompt": text, "multi_modal_data": {"image": images}}
