"""Serving utilities the engine never uses: Prometheus metrics, structured logs, the prefix index
of the routers, and the scaffolding both node servers share. May import pdserve.engine and the wire
package; never fabric, kv_messenger, the nodes, the router or pdserve.tools."""
