"""Anthropic's Messages API (``/v1/messages``): a thin translation into the chat serving and back.

``protocol.py`` holds the API's bodies and error shape, ``serving_messages.py`` the translation,
``api_router.py`` the routes.
"""
