from bench.tracing.run import main

raise SystemExit(main())
