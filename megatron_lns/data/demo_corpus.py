"""The embedded demo corpus: English prose that ships with every CPython.

``pydoc_data.topics`` holds the text of the Python language reference (about 0.5M
characters), so the demo needs no download. Each paragraph is a document. It is
prepared like any user data (see ``blend.py``: ``builtin:pydoc``).
"""

from __future__ import annotations


def demo_documents() -> list[str]:
    """Paragraphs of every ``pydoc_data.topics`` entry, in a fixed order."""
    from pydoc_data.topics import topics

    documents = []
    for key in sorted(topics):
        documents.extend(p.strip() for p in topics[key].split("\n\n") if p.strip())
    return documents
