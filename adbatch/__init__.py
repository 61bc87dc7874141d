"""adbatch: offline batch pipeline for LLM-based advertising.

Library layer (no Ray): data contracts, index building, trie, compression, decoding, metrics.
Nothing heavy happens at import time.
"""

__version__ = "0.1.0"
