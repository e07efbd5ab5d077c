"""Images in: what a vision-language model's prompt carries besides its tokens.

``inputs.py`` the plain data a request holds (each image's content hash, where its embeddings go in the
prompt, its preprocessed tiles); ``media.py`` images from chat content parts (data: URLs, allowed local
files, allowed remote hosts) with their size limits; ``idefics3.py`` SmolVLM's and ``clip.py`` LLaVA's
preprocessing (Pillow, equal to transformers' processors); ``processor.py`` a prompt and its images -> token
ids and ``ImageFeature``s, the preprocessing run on a thread pool; ``chat.py`` chat messages with image parts
-> prompt text and images. No module here imports the engine, the server or torch (the encoder cache, which
holds tensors, is the runner's: kvloom/worker/encoder_cache.py).
"""
