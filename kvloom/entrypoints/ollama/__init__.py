"""Ollama's HTTP API (``/api/chat``, ``/api/generate``, ``/api/embed``, the listings, ``/``): a thin translation
into the chat serving, the engine and the embeddings serving, and back.

``protocol.py`` holds the API's bodies, its error shape and ``parse_keep_alive``; ``serving_chat.py`` the
translation of chat and generate requests and their NDJSON streams; ``serving_models.py`` the model listings
and ``/api/embed``; ``api_router.py`` the routes.
"""
