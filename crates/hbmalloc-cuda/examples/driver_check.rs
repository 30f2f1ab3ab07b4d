//! Hardware check: loads the real CUDA driver, opens every device, runs the
//! same exercise sequence the tests run on the driver double, and prints
//! what it saw. Then it checks what policy `hbm`'s stitching rests on and no
//! double can show: bytes written through one mapping of a handle read back
//! through a second mapping of it, and, where the driver maps part of a
//! handle (`maps_handle_parts`), through a mapping of that part (cudarc's
//! memset and copy, on the device's primary context). Last, policy `hbm`
//! runs a program of allocations and frees on the device and every buffer
//! must keep its own bytes while memory is stitched around it
//! (`byte_check::byte_program`, as the tests run it on the driver double).
//!
//! ```text
//! cargo run -p hbmalloc-cuda --example driver_check
//! ```
//!
//! Exit status: 0 when every check held on every device, 1 when a check
//! failed or a driver call errored, 2 when no CUDA driver was found.

use std::process::ExitCode;

use cudarc::driver::{result, CudaContext};
use hbmalloc::Device;
use hbmalloc::{AllocatorConfig, PolicyConfig, StreamId};
use hbmalloc_cuda::byte_check::byte_program;
use hbmalloc_cuda::exercise::exercise_device;
use hbmalloc_cuda::{CudaDevice, CudaDriver, CudaPool};

fn main() -> ExitCode {
    let driver = match CudaDriver::load() {
        Ok(driver) => driver,
        Err(e) => {
            // `load` already says "no CUDA driver found" when it searched;
            // an explicit HBMALLOC_CUDA_DRIVER path fails more tersely.
            if e.detail.starts_with("no CUDA driver found") {
                eprintln!("{}", e.detail);
            } else {
                eprintln!("no CUDA driver found: {}", e.detail);
            }
            return ExitCode::from(2);
        }
    };
    println!("driver: {}", driver.path());
    let count = match driver.device_count() {
        Ok(count) => count,
        Err(e) => {
            eprintln!("the CUDA driver has no usable device: {e}");
            return ExitCode::from(1);
        }
    };
    println!("devices: {count}");
    let mut healthy = count > 0;
    for ordinal in 0..count {
        let device = match CudaDevice::new(driver.clone(), ordinal) {
            Ok(device) => device,
            Err(e) => {
                eprintln!("device {ordinal}: cannot open: {e}");
                healthy = false;
                continue;
            }
        };
        println!(
            "device {ordinal}: {} ({} bytes, granularity {:?}, access from {:?})",
            device.name(),
            device.total_bytes(),
            device.granularity(),
            device.access_ordinals()
        );
        match exercise_device(&device) {
            Ok(report) => {
                println!("device {ordinal}: {report:#?}");
                let failures = report.failures();
                if failures.is_empty() {
                    println!("device {ordinal}: all checks held");
                } else {
                    println!("device {ordinal}: FAILED: {}", failures.join(", "));
                    healthy = false;
                }
            }
            Err(e) => {
                println!("device {ordinal}: driver error: {e}");
                healthy = false;
            }
        }
        println!(
            "device {ordinal}: maps part of a handle: {}",
            device.maps_handle_parts()
        );
        match check_aliases(&device, ordinal) {
            Ok(()) => println!("device {ordinal}: aliased mappings share their bytes"),
            Err(e) => {
                println!("device {ordinal}: FAILED: aliased mappings: {e}");
                healthy = false;
            }
        }
        match check_buffers(device) {
            Ok(summary) => println!("device {ordinal}: {summary}"),
            Err(e) => {
                println!("device {ordinal}: FAILED: hbm byte check: {e}");
                healthy = false;
            }
        }
    }
    if healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// Policy `hbm` on this device with no allowance (so memory is stitched
/// often), 1,500 allocations and frees on the legacy default stream, every
/// buffer filled with its own byte and read back whole before its free
/// ([`byte_program`]); then everything goes back to the driver.
fn check_buffers(device: CudaDevice) -> Result<String, Box<dyn std::error::Error>> {
    let config = AllocatorConfig {
        policy: PolicyConfig::from_settings("policy:hbm,max_waste_percent:0")?,
        history_entries: 0,
    };
    let pool = CudaPool::with_device(device, config)?;
    let report = byte_program(&pool, pool.device(), 0, &[StreamId(0)], 1500)?;
    let stats = pool.stats();
    pool.empty_cache()?;
    Ok(format!(
        "hbm byte check: {} buffers kept their bytes ({} driver maps and creates, {} out of memory)",
        report.buffers, stats.num_device_alloc, report.out_of_memory
    ))
}

/// Maps one handle at two addresses (and, where the driver maps parts, its
/// second granule alone at a third) and checks that a byte pattern written
/// through one address reads back through the others. Everything made is
/// released, whatever fails.
fn check_aliases(device: &CudaDevice, ordinal: i32) -> Result<(), Box<dyn std::error::Error>> {
    let Some(g) = device.granularity() else {
        return Ok(()); // No virtual-memory API: nothing is aliased.
    };
    let context = CudaContext::new(usize::try_from(ordinal)?)?;
    context.bind_to_thread()?;
    let parts = device.maps_handle_parts();
    let handle_bytes = if parts { 2 * g } else { g };
    let base = device.address_reserve(6 * g)?;
    let handle = match device.physical_create(handle_bytes) {
        Ok(handle) => handle,
        Err(e) => {
            device.address_free(base, 6 * g)?;
            return Err(e.into());
        }
    };
    // Whole at `base` and at `base + 3g`; its second granule alone at `base + 5g`.
    let mut mapped: Vec<(u64, u64)> = Vec::new();
    let outcome = (|| -> Result<(), Box<dyn std::error::Error>> {
        for (va, size, offset) in [(base, handle_bytes, 0), (base + 3 * g, handle_bytes, 0)]
            .into_iter()
            .chain(parts.then_some((base + 5 * g, g, g)))
        {
            device.map(va, size, handle, offset)?;
            mapped.push((va, size));
            device.set_access(va, size)?;
        }
        let mut seen = vec![0u8; 4096];
        let mut expect =
            |written: u64, read: u64, byte: u8| -> Result<(), Box<dyn std::error::Error>> {
                // SAFETY: both addresses lie in ranges mapped above with access
                // granted, at least `seen.len()` bytes before their ends; the
                // primary context is current on this thread.
                unsafe {
                    result::memset_d8_sync(written, byte, seen.len())?;
                    result::memcpy_dtoh_sync(&mut seen, read)?;
                }
                if seen.iter().all(|&b| b == byte) {
                    Ok(())
                } else {
                    Err(
                        format!("wrote {byte:#x} at {written:#x}, read other bytes at {read:#x}")
                            .into(),
                    )
                }
            };
        expect(base, base + 3 * g, 0x5A)?;
        expect(base + 3 * g, base, 0xC3)?;
        if parts {
            expect(base + g, base + 5 * g, 0x3C)?;
            expect(base + 5 * g, base + 4 * g, 0xA5)?;
        }
        Ok(())
    })();
    for (va, size) in mapped {
        device.unmap(va, size)?;
    }
    device.physical_release(handle)?;
    device.address_free(base, 6 * g)?;
    outcome
}
