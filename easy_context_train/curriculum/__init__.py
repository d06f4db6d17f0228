"""The retrieval curriculum (issue #64): conversations that teach finding things in a long context, in wordings,
kinds and frames disjoint from every eval's, mixed with short chat and raw text (``rows.py`` states the loss
weighting). ``templates``: the wordings; ``spec``: one conversation as text; ``chat``: short chat turns;
``markup``: the chat template as ids; ``rows``: tokenized, placed in a haystack, packed into training rows.
``python -m easy_context retrieval-data`` (easy_context_train/retrieval_data.py) writes them.
"""
