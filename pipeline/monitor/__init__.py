"""The serving drafter after its promotion: acceptance as the RL engine reported it
(:mod:`.observed`), the live check that a promotion took (:mod:`.verify`), the drift that
asks for a refresh (:mod:`.drift`) and the picture of it all (:mod:`.chart`)."""
