"""Connection-level building blocks shared by the server and the client to D: one timer per
connection (``timers``), and the relay that writes the rest of a judged stream from D's
connection straight to the client's (``relay``). They import nothing of the request path."""
