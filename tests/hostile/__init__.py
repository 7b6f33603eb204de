"""A generated corpus of damaged and hostile checkpoints (issue 11), and the
oracle that runs Ravex on each one in a forked child.

``make_corpus.py`` lists the cases and builds any of them from the bundled
fixtures; nothing large is checked in.
"""
