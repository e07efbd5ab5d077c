"""kvloom's version, in a module of its own so that low layers can name it without importing the package's
public face (``kvloom/__init__.py`` re-exports ``LLM``, the top of the import graph)."""

__version__ = "0.1.0"
