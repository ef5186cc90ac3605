#pragma once
// Every reason the node agent answers or records: task failures and rejections, stage errors,
// node blockers, network/exposure drift and refusals, console refusals and close reasons. The
// texts are the wire contract (NodeTaskResult.error.reason, acks, blockers, ConsoleFrame).
// One entry a line (a test parses this file); README.md "Reasons" says what each means.
#include "gpuaas/common/result.hpp"

namespace gpuaas::node_agent::reason {

// clang-format off
// Task dispatch.
inline constexpr Reason kWrongNode{"wrong_node"};  // FAILED_PRECONDITION: a task for another node (rejected)
inline constexpr Reason kAgentIsolated{"agent_isolated"};  // FAILED_PRECONDITION: not registered with inventory (rejected)
inline constexpr Reason kTaskDeadlineExceeded{"deadline_exceeded"};  // DEADLINE_EXCEEDED: the task arrived after its deadline
inline constexpr Reason kUnknownTaskType{"unknown_task_type"};  // UNIMPLEMENTED: no handler for the task type (rejected)
inline constexpr Reason kInvalidParams{"invalid_params"};  // INVALID_ARGUMENT: params case is not the type's own (rejected)
inline constexpr Reason kInvalidConfig{"invalid_config"};  // INVALID_ARGUMENT: network/exposure settings do not fit together
inline constexpr Reason kDiscoveryFailed{"discovery_failed"};  // INTERNAL: discovery threw; topology not reported
inline constexpr Reason kProjectNetworksUnsupported{"project_networks_unsupported"};  // INVALID_ARGUMENT: VLAN/project networks set
inline constexpr Reason kNetworkCleanupFailed{"network_cleanup_failed"};  // UNAVAILABLE: a slot's network state not removed
inline constexpr Reason kNetworkCheckFailed{"network_check_failed"};  // blocker: CheckNetwork itself failed
inline constexpr Reason kSliceNetworkPresent{"slice_network_present"};  // blocker: a removed slice network is still on the host
// Local store.
inline constexpr Reason kLocalStoreIo{"local_store_io"};  // INTERNAL: the local store could not be read or written
inline constexpr Reason kInvalidKey{"invalid_key"};  // INVALID_ARGUMENT: a local store key that is not a safe file name
inline constexpr Reason kLocalStoreCorrupt{"local_store_corrupt"};  // DATA_LOSS: a stored record does not parse
// Host and tools.
inline constexpr Reason kHostRootMissing{"host_root_missing"};  // NOT_FOUND: node.host_root is not a directory
inline constexpr Reason kToolPathInvalid{"tool_path_invalid"};  // INVALID_ARGUMENT: a tool path that is not absolute
inline constexpr Reason kToolPipeFailed{"tool_pipe_failed"};  // INTERNAL: pipe() for a tool run failed
inline constexpr Reason kToolForkFailed{"tool_fork_failed"};  // INTERNAL: fork() for a tool run failed
inline constexpr Reason kToolExecFailed{"tool_exec_failed"};  // FAILED_PRECONDITION: the tool could not be executed
inline constexpr Reason kToolMissing{"tool_missing"};  // FAILED_PRECONDITION: a host tool is not installed
inline constexpr Reason kNetnsNotFound{"netns_not_found"};  // FAILED_PRECONDITION: the configured network namespace is absent
inline constexpr Reason kHostCommandTimeout{"host_command_timeout"};  // UNAVAILABLE: a host command timed out
inline constexpr Reason kHostCommandFailed{"host_command_failed"};  // INTERNAL: a host command exited non-zero
inline constexpr Reason kUnexpectedToolOutput{"unexpected_tool_output"};  // INTERNAL: a tool printed what we cannot parse
inline constexpr Reason kFixtureDirNotEmpty{"fixture_dir_not_empty"};  // FAILED_PRECONDITION: fixture host target not empty
inline constexpr Reason kFixtureWriteFailed{"fixture_write_failed"};  // INTERNAL: writing a fixture host tree failed
// Node blockers from prerequisite/baseline checks.
inline constexpr Reason kBridgeMissing{"bridge_missing"};  // FAILED_PRECONDITION/blocker: the slice bridge is absent
inline constexpr Reason kGatewayMissing{"gateway_missing"};  // blocker: no gateway address on the bridge
inline constexpr Reason kIpForwardDisabled{"ip_forward_disabled"};  // blocker: net.ipv4.ip_forward is not 1
inline constexpr Reason kNatMasqueradeMissing{"nat_masquerade_missing"};  // blocker: no MASQUERADE rule for the subnet
inline constexpr Reason kKvmMissing{"kvm_missing"};  // blocker: /dev/kvm missing
inline constexpr Reason kIommuUnavailable{"iommu_unavailable"};  // blocker: no IOMMU groups
inline constexpr Reason kVfioModulesMissing{"vfio_modules_missing"};  // blocker: vfio_pci not loaded
inline constexpr Reason kLibvirtUnavailable{"libvirt_unavailable"};  // UNAVAILABLE/blocker: libvirt cannot be reached
inline constexpr Reason kOvmfMissing{"ovmf_missing"};  // blocker: no OVMF firmware
inline constexpr Reason kHugepagesInsufficient{"hugepages_insufficient"};  // FAILED_PRECONDITION/blocker: too few 1G hugepages
inline constexpr Reason kKvmAccessFailed{"kvm_access_failed"};  // blocker fallback: check kvm_access
inline constexpr Reason kGpusFailed{"gpus_failed"};  // blocker fallback: check gpus
inline constexpr Reason kIommuCmdlineFailed{"iommu_cmdline_failed"};  // blocker fallback: check iommu_cmdline
inline constexpr Reason kSriovFailed{"sriov_failed"};  // blocker fallback: check sriov
inline constexpr Reason kRebootRequiredFailed{"reboot_required_failed"};  // blocker fallback: check reboot_required
inline constexpr Reason kDefaultRouteFailed{"default_route_failed"};  // blocker fallback: check default_route
inline constexpr Reason kTmfifoFailed{"tmfifo_failed"};  // blocker fallback: check tmfifo
inline constexpr Reason kOvsOffloadFailed{"ovs_offload_failed"};  // blocker fallback: check ovs_offload
inline constexpr Reason kCheckFailed{"check_failed"};  // blocker fallback: a check of a name not known here
// Node scheduler.
inline constexpr Reason kBundleEmpty{"bundle_empty"};  // INVALID_ARGUMENT: the bundle names no slots
inline constexpr Reason kInvalidAllocationId{"invalid_allocation_id"};  // INVALID_ARGUMENT: allocation_id is not a UUID
inline constexpr Reason kShapeInvalid{"shape_invalid"};  // INVALID_ARGUMENT: vCPU/memory shape out of range
inline constexpr Reason kInvalidImageDigest{"invalid_image_digest"};  // INVALID_ARGUMENT: image sha256 not 64 lowercase hex
inline constexpr Reason kInvalidMac{"invalid_mac"};  // INVALID_ARGUMENT: not a unicast xx:xx:xx:xx:xx:xx MAC
inline constexpr Reason kInvalidIp{"invalid_ip"};  // INVALID_ARGUMENT: not a dotted IPv4 address
inline constexpr Reason kDuplicateResource{"duplicate_resource"};  // INVALID_ARGUMENT: two slots name one GPU/VF/disk/MAC/IP
inline constexpr Reason kGpuNotFound{"gpu_not_found"};  // NOT_FOUND: the slot's GPU is not on this host
inline constexpr Reason kFabricVfNotFound{"fabric_vf_not_found"};  // NOT_FOUND: the slot's fabric VF is not on this host
inline constexpr Reason kDiskNotFound{"disk_not_found"};  // NOT_FOUND/FAILED_PRECONDITION: the slot's disk is not on this host
inline constexpr Reason kOsDisk{"os_disk"};  // FAILED_PRECONDITION: the slot's disk is the OS disk
inline constexpr Reason kDiskMounted{"disk_mounted"};  // FAILED_PRECONDITION: the slot's disk is mounted
inline constexpr Reason kDiskChildMounted{"disk_child_mounted"};  // FAILED_PRECONDITION: a partition or holder is mounted
inline constexpr Reason kSlotLeased{"slot_leased"};  // FAILED_PRECONDITION: another allocation's lease holds the slot
inline constexpr Reason kLeaseTimeout{"lease_timeout"};  // DEADLINE_EXCEEDED: no DHCP lease within the readiness timeout
// Domain xml.
inline constexpr Reason kInvalidTenant{"invalid_tenant"};  // INVALID_ARGUMENT: tenant is not printable UTF-8
inline constexpr Reason kInvalidSlotKey{"invalid_slot_key"};  // INVALID_ARGUMENT: a slot key unfit for names and paths
inline constexpr Reason kHugepagesMemoryUnaligned{"hugepages_memory_unaligned"};  // INVALID_ARGUMENT: memory not whole 1G pages
inline constexpr Reason kSeedMissing{"seed_missing"};  // INVALID_ARGUMENT: no NoCloud seed ISO given
inline constexpr Reason kInvalidPath{"invalid_path"};  // INVALID_ARGUMENT: a path that is not absolute or not safe in XML
inline constexpr Reason kInvalidDomainType{"invalid_domain_type"};  // INVALID_ARGUMENT: domain type is not kvm or qemu
inline constexpr Reason kVncListenNotLoopback{"vnc_listen_not_loopback"};  // INVALID_ARGUMENT: VNC would listen off loopback
inline constexpr Reason kInvalidBridge{"invalid_bridge"};  // INVALID_ARGUMENT: a bad bridge name
inline constexpr Reason kInvalidPciAddress{"invalid_pci_address"};  // INVALID_ARGUMENT: a missing or malformed PCI address
// Libvirt runtime.
inline constexpr Reason kLibvirtError{"libvirt_error"};  // INTERNAL: a libvirt call failed
inline constexpr Reason kDeviceAttached{"device_attached"};  // FAILED_PRECONDITION: another domain holds the PCI device
inline constexpr Reason kUndefineFailed{"undefine_failed"};  // INTERNAL: the domain could not be undefined
inline constexpr Reason kDiskNotBlockDevice{"disk_not_block_device"};  // FAILED_PRECONDITION: the disk path is no block device
inline constexpr Reason kDiskHeld{"disk_held"};  // FAILED_PRECONDITION: a dm/md device is stacked on the disk
inline constexpr Reason kDiskBusy{"disk_busy"};  // FAILED_PRECONDITION: the disk is in exclusive use (O_EXCL)
inline constexpr Reason kDiskUnreadable{"disk_unreadable"};  // FAILED_PRECONDITION: the disk cannot be opened
inline constexpr Reason kInvalidHostname{"invalid_hostname"};  // INVALID_ARGUMENT: not an RFC 1123 label
inline constexpr Reason kInvalidInstanceId{"invalid_instance_id"};  // INVALID_ARGUMENT: a bad cloud-init instance id
inline constexpr Reason kInvalidSshKey{"invalid_ssh_key"};  // INVALID_ARGUMENT: an SSH key unfit for cloud-init
inline constexpr Reason kRelayKeyUnavailable{"relay_key_unavailable"};  // INTERNAL: the agent's relay SSH key not made
inline constexpr Reason kSeedWriteFailed{"seed_write_failed"};  // INTERNAL: the NoCloud seed files not written
inline constexpr Reason kSeedBuildFailed{"seed_build_failed"};  // INTERNAL: the seed ISO not built
inline constexpr Reason kNetworkNotApplied{"network_not_applied"};  // UNAVAILABLE: the slice network is not applied yet
inline constexpr Reason kDomainRunning{"domain_running"};  // FAILED_PRECONDITION: the domain already runs another definition
inline constexpr Reason kDefineFailed{"define_failed"};  // INTERNAL: libvirt refused the domain definition
inline constexpr Reason kStartFailed{"start_failed"};  // INTERNAL: the domain did not start
inline constexpr Reason kDomainNotRunning{"domain_not_running"};  // FAILED_PRECONDITION: the domain stopped during readiness
inline constexpr Reason kLeaseMismatch{"lease_mismatch"};  // FAILED_PRECONDITION: the guest leased another IP
inline constexpr Reason kSshTimeout{"ssh_timeout"};  // DEADLINE_EXCEEDED: no SSH banner within the readiness timeout
inline constexpr Reason kDestroyFailed{"destroy_failed"};  // INTERNAL: the domain could not be destroyed
inline constexpr Reason kWipeFailed{"wipe_failed"};  // INTERNAL: wiping the disk failed
inline constexpr Reason kVerifyFailed{"verify_failed"};  // INTERNAL: checking the wiped disk failed
inline constexpr Reason kSignaturesRemaining{"signatures_remaining"};  // INTERNAL: signatures left on the disk after a wipe
// Image cache.
inline constexpr Reason kImageCacheUnusable{"image_cache_unusable"};  // INTERNAL: the image cache directory cannot be used
inline constexpr Reason kImageFetchFailed{"image_fetch_failed"};  // UNAVAILABLE/FAILED_PRECONDITION: the image download failed
inline constexpr Reason kImageNotFound{"image_not_found"};  // NOT_FOUND: the image URL answered 404
inline constexpr Reason kImageUnreadable{"image_unreadable"};  // INTERNAL: qemu-img cannot read the image
inline constexpr Reason kImageHasBackingFile{"image_has_backing_file"};  // FAILED_PRECONDITION: a qcow2 with a backing file
inline constexpr Reason kImageFormatUnsupported{"image_format_unsupported"};  // FAILED_PRECONDITION: not raw or qcow2
inline constexpr Reason kInvalidBundle{"invalid_bundle"};  // INVALID_ARGUMENT: the image digest is malformed
inline constexpr Reason kImageUrlUnsupported{"image_url_unsupported"};  // INVALID_ARGUMENT: not file, http or https
inline constexpr Reason kImageDigestMismatch{"image_digest_mismatch"};  // FAILED_PRECONDITION: the image's sha256 differs
inline constexpr Reason kImageChanged{"image_changed"};  // INTERNAL: the cached image changed while written
inline constexpr Reason kDiskTooSmall{"disk_too_small"};  // FAILED_PRECONDITION: the image does not fit the disk
inline constexpr Reason kImageWriteFailed{"image_write_failed"};  // INTERNAL: writing the image onto the disk failed
// Slice network.
inline constexpr Reason kInvalidStateDir{"invalid_state_dir"};  // INVALID_ARGUMENT: state_dir is not a safe absolute path
inline constexpr Reason kInvalidNetns{"invalid_netns"};  // INVALID_ARGUMENT: a bad network namespace name
inline constexpr Reason kInvalidEgressIface{"invalid_egress_iface"};  // INVALID_ARGUMENT: a bad egress interface
inline constexpr Reason kInvalidSubnet{"invalid_subnet"};  // INVALID_ARGUMENT: subnet_cidr not a /8../30 network
inline constexpr Reason kInvalidGateway{"invalid_gateway"};  // INVALID_ARGUMENT: gateway_cidr malformed or not a host
inline constexpr Reason kGatewayOutsideSubnet{"gateway_outside_subnet"};  // INVALID_ARGUMENT: gateway outside the subnet
inline constexpr Reason kSubnetTooSmall{"subnet_too_small"};  // INVALID_ARGUMENT: the subnet cannot hold the reservations
inline constexpr Reason kDuplicateMac{"duplicate_mac"};  // INVALID_ARGUMENT: two reservations name one MAC
inline constexpr Reason kIpOutsideSubnet{"ip_outside_subnet"};  // INVALID_ARGUMENT: a reservation IP outside the subnet
inline constexpr Reason kIpReserved{"ip_reserved"};  // INVALID_ARGUMENT: network, broadcast or gateway address reserved
inline constexpr Reason kDuplicateIp{"duplicate_ip"};  // INVALID_ARGUMENT: two reservations name one IP
inline constexpr Reason kDuplicateHostname{"duplicate_hostname"};  // INVALID_ARGUMENT: two reservations name one hostname
inline constexpr Reason kStateWriteFailed{"state_write_failed"};  // INTERNAL: a network state file not written
inline constexpr Reason kStateDirUnusable{"state_dir_unusable"};  // FAILED_PRECONDITION: the state dir cannot be used
inline constexpr Reason kStateDirNotTraversable{"state_dir_not_traversable"};  // FAILED_PRECONDITION: dnsmasq cannot reach it
inline constexpr Reason kGatewayConflict{"gateway_conflict"};  // FAILED_PRECONDITION/blocker: the gateway is on another link
inline constexpr Reason kForeignFlows{"foreign_flows"};  // FAILED_PRECONDITION/blocker: OpenFlow rules we did not install
inline constexpr Reason kDnsmasqCannotReadHosts{"dnsmasq_cannot_read_hosts"};  // FAILED_PRECONDITION: hosts file unreadable
inline constexpr Reason kDhcpServerConflict{"dhcp_server_conflict"};  // FAILED_PRECONDITION: another DHCP server on the bridge
inline constexpr Reason kDnsmasqStartFailed{"dnsmasq_start_failed"};  // UNAVAILABLE: dnsmasq did not come up
inline constexpr Reason kDnsmasqReloadFailed{"dnsmasq_reload_failed"};  // UNAVAILABLE: dnsmasq did not reload
inline constexpr Reason kBridgeNameConflict{"bridge_name_conflict"};  // FAILED_PRECONDITION: the name is another kind of link
inline constexpr Reason kBridgeNotCreated{"bridge_not_created"};  // UNAVAILABLE: ovs-vswitchd did not create the bridge
inline constexpr Reason kLeaseStillPresent{"lease_still_present"};  // INTERNAL: a DHCP lease survived its release
inline constexpr Reason kBridgeDown{"bridge_down"};  // blocker: the slice bridge is down
inline constexpr Reason kGatewayAddressMissing{"gateway_address_missing"};  // blocker: the gateway address is not on the bridge
inline constexpr Reason kIpForwardOff{"ip_forward_off"};  // blocker: IPv4 forwarding is off
inline constexpr Reason kMasqueradeMissing{"masquerade_missing"};  // blocker: the subnet's MASQUERADE rule is absent
inline constexpr Reason kForwardRulesMissing{"forward_rules_missing"};  // blocker: the FORWARD rules are absent
inline constexpr Reason kPortsNotIsolated{"ports_not_isolated"};  // blocker: bridge ports can reach each other
inline constexpr Reason kFlowsStale{"flows_stale"};  // blocker: the bridge's OpenFlow rules differ from the spec
inline constexpr Reason kDnsmasqNotRunning{"dnsmasq_not_running"};  // blocker: the slice dnsmasq is not running
inline constexpr Reason kDnsmasqConfigStale{"dnsmasq_config_stale"};  // blocker: dnsmasq's config differs from the spec
inline constexpr Reason kReservationsStale{"reservations_stale"};  // blocker: dnsmasq's hosts file differs from the spec
inline constexpr Reason kStaleDnsmasqFiles{"stale_dnsmasq_files"};  // blocker: leftover dnsmasq files of removed slices
inline constexpr Reason kQosMissing{"qos_missing"};  // slot drift: the vNIC's policing/tag/isolation differs
inline constexpr Reason kVnicDetached{"vnic_detached"};  // slot drift: the guest's tap is on no bridge or another
inline constexpr Reason kVnicHostStackOpen{"vnic_host_stack_open"};  // slot drift: the port answers ARP or forwards
inline constexpr Reason kOvsTableInvalid{"ovs_table_invalid"};  // INVALID_ARGUMENT: ovs-vsctl printed no usable table
// Exposures.
inline constexpr Reason kInvalidVersion{"invalid_version"};  // INVALID_ARGUMENT: exposure document version below 1
inline constexpr Reason kInvalidUplink{"invalid_uplink"};  // INVALID_ARGUMENT: exposure.uplink is not an interface name
inline constexpr Reason kFabricInterface{"fabric_interface"};  // INVALID_ARGUMENT: exposure.uplink is InfiniBand/RoCE
inline constexpr Reason kInvalidSliceIp{"invalid_slice_ip"};  // INVALID_ARGUMENT: a slice IP outside the subnet
inline constexpr Reason kInvalidTargetIp{"invalid_target_ip"};  // INVALID_ARGUMENT: target_ip is not dotted IPv4
inline constexpr Reason kInvalidExposureId{"invalid_exposure_id"};  // refused: exposure_id is not a UUID
inline constexpr Reason kInvalidProtocol{"invalid_protocol"};  // refused: protocol is not tcp or udp
inline constexpr Reason kInvalidPublicIp{"invalid_public_ip"};  // refused: public_ip is not this uplink's address
inline constexpr Reason kInvalidPort{"invalid_port"};  // refused: a port outside 1..65535
inline constexpr Reason kTargetNotSlice{"target_not_slice"};  // refused: the target is not an IP of the applied network
inline constexpr Reason kDuplicateEndpoint{"duplicate_endpoint"};  // refused: two exposures name one public endpoint
inline constexpr Reason kScriptWriteFailed{"script_write_failed"};  // INTERNAL: the nft script not written
inline constexpr Reason kExposureCheckFailed{"exposure_check_failed"};  // drift: CheckExposures itself failed
inline constexpr Reason kExposureStillMapped{"exposure_still_mapped"};  // UNAVAILABLE: a removed slot still has mappings
inline constexpr Reason kTableMissing{"table_missing"};  // drift: the exposure nft table is absent
inline constexpr Reason kRuleMissing{"rule_missing"};  // drift: an exposure's rule is absent
inline constexpr Reason kRuleStale{"rule_stale"};  // drift: an exposure's rule differs from the spec
inline constexpr Reason kRuleForeign{"rule_foreign"};  // drift: a rule or chain the platform did not install
inline constexpr Reason kChainStale{"chain_stale"};  // drift: a base chain is absent or differs
// Console.
inline constexpr Reason kDomainNotManaged{"domain_not_managed"};  // FAILED_PRECONDITION: no VM of this allocation here
inline constexpr Reason kConsoleUnavailable{"console_unavailable"};  // FAILED_PRECONDITION: the VM has no usable VNC socket
inline constexpr Reason kAgentStopping{"agent_stopping"};  // UNAVAILABLE/close: the agent is stopping
inline constexpr Reason kInvalidSessionId{"invalid_session_id"};  // INVALID_ARGUMENT: session_id is not a UUID
inline constexpr Reason kOpenByRequired{"open_by_required"};  // INVALID_ARGUMENT: an open without its validity
inline constexpr Reason kOpenExpired{"open_expired"};  // DEADLINE_EXCEEDED: the open arrived after its validity
inline constexpr Reason kInvalidWindowBytes{"invalid_window_bytes"};  // INVALID_ARGUMENT: window_bytes out of range
inline constexpr Reason kInvalidMaxDuration{"invalid_max_duration"};  // INVALID_ARGUMENT: a negative max_duration_s
inline constexpr Reason kSessionOpen{"session_open"};  // ALREADY_EXISTS: the session is already open
inline constexpr Reason kTooManySessions{"too_many_sessions"};  // RESOURCE_EXHAUSTED: the relay limit is reached
inline constexpr Reason kSocketFailed{"socket_failed"};  // INTERNAL: socket() for the VNC socket failed
inline constexpr Reason kEventfdFailed{"eventfd_failed"};  // INTERNAL: eventfd() failed
inline constexpr Reason kRelayLost{"relay_lost"};  // close: a frame lost, reordered or malformed, or poll failed
inline constexpr Reason kCreditExceeded{"credit_exceeded"};  // close: the gw sent beyond its credit window
inline constexpr Reason kClientClosed{"client_closed"};  // close: the gw closed without a reason
inline constexpr Reason kMaxDuration{"max_duration"};  // close: the session reached its max duration
inline constexpr Reason kVmClosed{"vm_closed"};  // close: the VM's VNC socket closed
// Driver binding of passthrough devices (host/pci_binding.hpp; blockers are <kind>_<pci address>).
inline constexpr Reason kSysfsWriteFailed{"sysfs_write_failed"};  // FAILED_PRECONDITION: the kernel refused a sysfs write
inline constexpr Reason kSysfsDeviceBusy{"sysfs_device_busy"};  // FAILED_PRECONDITION: EBUSY: the device cannot leave its driver now
inline constexpr Reason kVfioBindingLost{"vfio_binding_lost"};  // blocker: slice-vm, a passthrough device not on vfio-pci
inline constexpr Reason kVfioStillBound{"vfio_still_bound"};  // blocker: baremetal, a device still on vfio-pci
inline constexpr Reason kBindFailed{"bind_failed"};  // blocker: a binding write was refused
inline constexpr Reason kRebootRequired{"reboot_required"};  // blocker: the device cannot be released without a reboot
// clang-format on

}  // namespace gpuaas::node_agent::reason
