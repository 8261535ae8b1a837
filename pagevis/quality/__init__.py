"""pagevis.quality: the engine of `pagevis compare` and `pagevis eval` — teacher-forced quality of each eviction
policy at each cache budget against the full cache (`measure`), and the clairvoyant reference policy fed the
reference's future attention (`optimal`)."""
