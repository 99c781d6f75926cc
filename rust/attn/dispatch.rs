//! Kernel tiers and their run-time selection: probed once per `CpuAttention`, overridable with
//! `NEO_RS_SIMD=scalar|avx2|avx512|neon`. Never compiled for the build host (`target-cpu=native`).

use crate::attn::element::{Element, KvElement};
use crate::attn::kernel::{self, Geometry, Item, Scratch};
use crate::attn::simd::{Portable, Simd};
use crate::attn::split::Kernel;
use crate::config;
use crate::error::{NeoError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Scalar,
    Avx2,
    Avx512,
    Neon,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Scalar, Tier::Avx2, Tier::Avx512, Tier::Neon];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Scalar => "scalar",
            Tier::Avx2 => "avx2",
            Tier::Avx512 => "avx512",
            Tier::Neon => "neon",
        }
    }

    pub fn parse(s: &str) -> Result<Tier> {
        Tier::ALL
            .into_iter()
            .find(|t| t.name() == s.trim().to_ascii_lowercase())
            .ok_or_else(|| NeoError::Value(format!("unknown SIMD tier {s:?}; expected scalar, avx2, avx512 or neon")))
    }

    /// Whether this CPU can run the tier.
    pub fn is_supported(self) -> bool {
        match self {
            Tier::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512 => {
                Tier::Avx2.is_supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(target_arch = "aarch64")]
            Tier::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Every tier this CPU supports, slowest first.
    pub fn supported() -> Vec<Tier> {
        Tier::ALL.into_iter().filter(|t| t.is_supported()).collect()
    }

    /// The fastest supported tier.
    pub fn best() -> Tier {
        *Tier::supported().last().unwrap_or(&Tier::Scalar)
    }

    /// `NEO_RS_SIMD` if set (an error when this CPU lacks it), else the best tier.
    pub fn from_env() -> Result<Tier> {
        match config::simd_tier() {
            Some(s) => Tier::parse(&s)?.require(),
            None => Ok(Tier::best()),
        }
    }

    /// `self`, or an error when this CPU cannot run it.
    pub fn require(self) -> Result<Tier> {
        if self.is_supported() {
            Ok(self)
        } else {
            Err(NeoError::Runtime(format!("SIMD tier {} is not supported by this CPU", self.name())))
        }
    }

    /// Whether int8 K pools take q·k as int8 dot products on this tier and CPU (AVX-512 VNNI;
    /// q is then quantized per head, so scores carry its rounding too). `NEO_RS_INT8_DOT=0`
    /// turns it off.
    pub fn int8_dot(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self == Tier::Avx512 {
            return config::int8_dot_allowed() && std::arch::is_x86_feature_detected!("avx512vnni");
        }
        false
    }

    /// The item function of this tier for q/output type `Q` and KV pools of `K` (int8 pools with
    /// int8 dot products if `int8_dot`, which `int8_dot()` must allow).
    pub(crate) fn kernel<Q: Element, K: KvElement>(self, int8_dot: bool) -> Result<Kernel<Q, K>> {
        self.require()?;
        Ok(match self {
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => Kernel { lanes: 8, item: crate::attn::x86::avx2::attend_item::<Q, K> },
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512 if K::SCALED && int8_dot => {
                Kernel { lanes: 16, item: crate::attn::x86::avx512::attend_item_vnni::<Q, K> }
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512 => Kernel { lanes: 16, item: crate::attn::x86::avx512::attend_item::<Q, K> },
            #[cfg(target_arch = "aarch64")]
            Tier::Neon => Kernel { lanes: 4, item: crate::attn::aarch64::neon::attend_item::<Q, K> },
            _ => Kernel { lanes: Portable::LANES, item: scalar_item::<Q, K> },
        })
    }
}

/// The scalar reference tier's item function.
unsafe fn scalar_item<Q: Element, K: KvElement>(
    it: &Item<'_, Q, K>,
    geo: &Geometry,
    scratch: &mut Scratch,
    partial: &mut [f32],
) {
    // SAFETY: the portable tier runs on any CPU; the scratch contract is forwarded.
    unsafe { kernel::attend_item::<Portable, Q, K, false>(it, geo, scratch, partial) }
}
