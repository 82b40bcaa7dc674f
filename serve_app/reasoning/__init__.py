"""Thinking models: which tokens open and close a thought (``markers``), where a request's
output starts and how its tokens split into thought and answer (``split``), and the budget
that ends a thought and keeps a grammar to the answer (``budget``).

Everything here works on token ids, never on text: a thought's end is the model's own
end-of-thinking token, whatever text the tokens around it decode to.
"""
