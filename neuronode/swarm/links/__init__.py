"""How a member is reached, and nothing else: routes (pure), the one retry backoff, sessions
for members nobody can dial, relays between them, and `Links`, through which every call goes.
Nothing here imports the transport, peers or the other users of a link: what a session
delivers goes up through an `Inbox`."""

from neuronode.swarm.links.backoff import retry_until
from neuronode.swarm.links.lanes import SessionClosed
from neuronode.swarm.links.links import Links, NoRoute
from neuronode.swarm.links.route import Carried, Dial, Relayed, Route, Unreachable, relay_for, route
from neuronode.swarm.links.sessions import Inbox, SessionStuck

__all__ = ["Carried", "Dial", "Inbox", "Links", "NoRoute", "Relayed", "Route", "SessionClosed", "SessionStuck",
           "Unreachable", "relay_for", "retry_until", "route"]
