"""Network emulation: shaped clusters in network namespaces with tc links (netns) and measuring them
(netcheck)."""
