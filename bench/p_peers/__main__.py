from bench.p_peers.run import main

raise SystemExit(main())
