"""The release decision, in one home: from what happened to a request to what P gets.

``judge`` (the decision, step by step, the job it hands the release pipeline,
the veto on parameters D may still be reading, and a 200 stream judged from
its first event), ``policy`` (how sidecar and router mode read an exchange's
fate), ``coverage`` (whether D's own engine releases a rejection itself) and
``sse`` (a stream's first SSE event, read without holding the stream).
Nothing here imports the request path: the judge reads an exchange through a
small Protocol (``sidecar.decision.judge.Case``).
"""
