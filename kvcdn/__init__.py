"""kvcdn: a content delivery network for LLM knowledge.

Publish a document's KV cache once (:func:`kvcdn.publish.publish`), load it
anywhere (:func:`kvcdn.sdk.load_context`). The core package knows nothing of
the CLI, the SDK or the edge servers.
"""

from .errors import KvcdnError

__version__ = "0.1.0"
__all__ = ["KvcdnError", "__version__"]
