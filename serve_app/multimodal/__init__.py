"""Images in: decoding and bounding them, the model's processor and vision tower, and the
splice that puts their features into the text stack's prompt inside the running batch."""
