"""The release decision, in one home: from what happened to a request to what P gets.

``judge`` (the decision, step by step, and the job it hands the release
pipeline), ``policy`` (how sidecar and router mode read an exchange's fate),
``inflight`` (the veto on parameters D may still be reading) and ``coverage``
(whether D's own engine releases a rejection itself). Nothing here imports the
request path: the judge reads an exchange through a small Protocol
(``sidecar.decision.judge.Case``).
"""
