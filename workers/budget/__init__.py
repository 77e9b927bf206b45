"""The speculation budget: how many draft tokens each request sends to the verifier."""
